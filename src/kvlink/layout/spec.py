"""Model and KV-cache-group specs: what a model's KV memory is made of, TP-independent."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Literal

from kvlink.layout.limits import MAX_MODEL_DIM, MAX_TOKENS, MODEL_DIM, check, int_range

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ShardedPart:
    """One piece of a page: `units` equal units (heads, conv groups) sharded over TP ranks.

    A unit is `unit_elems` contiguous elements. On a rank the part holds
    `units_on_rank(tp)` consecutive units starting at global unit `first_unit(rank, tp)`.
    With `replicated=True` every rank holds every unit (MLA latent).
    """

    name: str
    units: int
    unit_elems: int
    replicated: bool = False

    def __post_init__(self) -> None:
        check(f"part {self.name!r} units", self.units, MODEL_DIM)
        check(f"part {self.name!r} unit_elems", self.unit_elems, int_range(1, MAX_MODEL_DIM**2))

    def units_on_rank(self, tp_size: int) -> int:
        if self.replicated:
            return self.units
        if tp_size <= self.units:
            if self.units % tp_size:
                raise ValueError(
                    f"part {self.name!r}: {self.units} units cannot be split over TP {tp_size}; "
                    "use a TP size that divides it"
                )
            return self.units // tp_size
        if tp_size % self.units:
            raise ValueError(
                f"part {self.name!r}: TP {tp_size} exceeds {self.units} units and is not a "
                "multiple of it; replicated units need TP to be a multiple of the unit count"
            )
        return 1

    def first_unit(self, tp_rank: int, tp_size: int) -> int:
        if self.replicated:
            return 0
        if tp_size <= self.units:
            return tp_rank * (self.units // tp_size)
        return tp_rank * self.units // tp_size


@dataclass(frozen=True)
class FullAttention:
    kind: Literal["full"] = "full"


@dataclass(frozen=True)
class SlidingWindow:
    window: int
    kind: Literal["sliding"] = "sliding"

    def __post_init__(self) -> None:
        check("sliding window", self.window, int_range(1, MAX_TOKENS))


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention: one latent vector per token, the same on every rank."""

    latent_dim: int
    kind: Literal["mla"] = "mla"

    def __post_init__(self) -> None:
        check("MLA latent_dim", self.latent_dim, MODEL_DIM)


@dataclass(frozen=True)
class Mamba2:
    """Mamba2 layer state: conv state over x | B | C (dim-first), then the SSM state."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    kind: Literal["mamba2"] = "mamba2"

    def __post_init__(self) -> None:
        _check_ssm_dims(self)

    def conv_parts(self) -> tuple[ShardedPart, ...]:
        rows = self.conv_kernel - 1
        return (
            ShardedPart("conv_x", self.num_heads, self.head_dim * rows),
            ShardedPart("conv_B", self.n_groups, self.d_state * rows),
            ShardedPart("conv_C", self.n_groups, self.d_state * rows),
        )

    def state_part(self) -> ShardedPart:
        return ShardedPart("ssm_state", self.num_heads, self.head_dim * self.d_state)


@dataclass(frozen=True)
class GDN:
    """Gated DeltaNet layer state: conv state over Q | K | V (dim-first), then the recurrent state."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    kind: Literal["gdn"] = "gdn"

    def __post_init__(self) -> None:
        _check_ssm_dims(self)

    def conv_parts(self) -> tuple[ShardedPart, ...]:
        rows = self.conv_kernel - 1
        return (
            ShardedPart("conv_Q", self.num_k_heads, self.head_k_dim * rows),
            ShardedPart("conv_K", self.num_k_heads, self.head_k_dim * rows),
            ShardedPart("conv_V", self.num_v_heads, self.head_v_dim * rows),
        )

    def state_part(self) -> ShardedPart:
        return ShardedPart("ssm_state", self.num_v_heads, self.head_v_dim * self.head_k_dim)


def _check_ssm_dims(group: Mamba2 | GDN) -> None:
    """Every dim in [1, MAX_MODEL_DIM]; the conv state keeps `conv_kernel - 1` rows, so >= 2."""
    for name, value in vars(group).items():
        if name == "conv_kernel":
            check(f"{group.kind} conv_kernel", value, int_range(2, MAX_MODEL_DIM))
        elif name != "kind":
            check(f"{group.kind} {name}", value, MODEL_DIM)


GroupSpec = FullAttention | SlidingWindow | MLA | Mamba2 | GDN
SSM_KINDS = ("mamba2", "gdn")
_GROUP_TYPES: dict[str, type] = {
    "full": FullAttention,
    "sliding": SlidingWindow,
    "mla": MLA,
    "mamba2": Mamba2,
    "gdn": GDN,
}


def is_ssm(group: GroupSpec) -> bool:
    return group.kind in SSM_KINDS


@dataclass(frozen=True)
class ModelSpec:
    """A model's KV memory: layers assigned to groups, plus the attention head geometry.

    `layer_groups[i]` is the index in `groups` of layer i's group. Attention groups
    (full, sliding) use `num_kv_heads` x `head_dim`; MLA and SSM groups carry their own dims.
    """

    name: str
    num_kv_heads: int
    head_dim: int
    dtype: str
    groups: tuple[GroupSpec, ...]
    layer_groups: tuple[int, ...]

    def __post_init__(self) -> None:
        check("num_kv_heads", self.num_kv_heads, MODEL_DIM)
        check("head_dim", self.head_dim, MODEL_DIM)
        check("number of layers", len(self.layer_groups), MODEL_DIM)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} not supported; expected one of {sorted(DTYPE_BYTES)}")
        bad = [g for g in self.layer_groups if not 0 <= g < len(self.groups)]
        if bad:
            raise ValueError(f"layer_groups names groups {bad} but the model has {len(self.groups)}")
        unused = set(range(len(self.groups))) - set(self.layer_groups)
        if unused:
            raise ValueError(f"groups {sorted(unused)} have no layers")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)

    def layers_of(self, group_index: int) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.layer_groups) if g == group_index)

    def attention_part(self) -> ShardedPart:
        """Attention unit = one KV head of one kernel block: `block_size * 2 * head_dim` elements.

        `unit_elems` here is per token; multiply by the block size for a page.
        """
        return ShardedPart("kv", self.num_kv_heads, 2 * self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "groups": [asdict(g) for g in self.groups],
            "layer_groups": list(self.layer_groups),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        try:
            groups = []
            for g in data["groups"]:
                fields = dict(g)
                kind = fields.pop("kind")
                groups.append(_GROUP_TYPES[kind](**fields))
            return cls(
                name=str(data["name"]),
                num_kv_heads=_wire_int(data, "num_kv_heads"),
                head_dim=_wire_int(data, "head_dim"),
                dtype=str(data["dtype"]),
                groups=tuple(groups),
                layer_groups=tuple(_wire_int({"layer_groups": x}, "layer_groups") for x in data["layer_groups"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed model spec: {exc!r}") from exc

    def compat_hash(self) -> str:
        """Stable hash of everything that must match between P and D (not TP or block size)."""
        try:
            return _cached_compat_hash(self)
        except TypeError:  # a spec built with lists instead of tuples is not hashable
            return _compat_hash(self)


def _wire_int(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if type(value) is not int:
        raise ValueError(f"malformed model spec: {key} must be an integer, got {value!r}")
    return value


def _compat_hash(spec: ModelSpec) -> str:
    blob = json.dumps(spec.to_dict(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Planning one reader against a wide engine compares the spec once per source rank.
_cached_compat_hash = lru_cache(maxsize=64)(_compat_hash)
