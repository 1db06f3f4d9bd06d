"""Model and KV-cache-group specs: what a model's KV memory is made of, TP-independent."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Literal

from kvlink.layout.limits import MAX_MODEL_DIM, MAX_TOKENS, MODEL_DIM, check, int_range

# KV cache element types. The fp8 ones are quantized caches (vLLM's `--kv-cache-dtype fp8`):
# kvlink moves their bytes as they are, so P and D must also agree on the scales (`kv_scales`).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


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


ConvLayout = Literal["DS", "SD"]
CONV_LAYOUTS: tuple[ConvLayout, ...] = ("DS", "SD")
MAX_SD_CONV_KERNEL = 65
STATE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Mamba2:
    """Mamba2 layer state: conv state over x | B | C, then the SSM state.

    `conv_layout` is how a rank stores its conv state of `conv_kernel - 1` rows over its
    channels (x | B | C, each its own heads or groups): "DS" channel-first
    `(channels, rows)`, "SD" row-first `(rows, channels)` (vLLM's default). `state_dtype`
    is the SSM state's element type when it is not the model's (vLLM's
    `--mamba-ssm-cache-dtype`, e.g. fp32 state next to a bf16 conv state); "" for the model's.
    """

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    kind: Literal["mamba2"] = "mamba2"
    conv_layout: ConvLayout = "DS"
    state_dtype: str = ""

    def __post_init__(self) -> None:
        _check_ssm_dims(self)

    def conv_parts(self) -> tuple[ShardedPart, ...]:
        return _conv_parts(self.conv_layout, self.conv_kernel - 1, (
            ("conv_x", self.num_heads, self.head_dim),
            ("conv_B", self.n_groups, self.d_state),
            ("conv_C", self.n_groups, self.d_state),
        ))

    def state_part(self) -> ShardedPart:
        return ShardedPart("ssm_state", self.num_heads, self.head_dim * self.d_state)


@dataclass(frozen=True)
class GDN:
    """Gated DeltaNet layer state: conv state over Q | K | V (`conv_layout` as for Mamba2), then the recurrent state."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    kind: Literal["gdn"] = "gdn"
    conv_layout: ConvLayout = "DS"
    state_dtype: str = ""

    def __post_init__(self) -> None:
        _check_ssm_dims(self)

    def conv_parts(self) -> tuple[ShardedPart, ...]:
        return _conv_parts(self.conv_layout, self.conv_kernel - 1, (
            ("conv_Q", self.num_k_heads, self.head_k_dim),
            ("conv_K", self.num_k_heads, self.head_k_dim),
            ("conv_V", self.num_v_heads, self.head_v_dim),
        ))

    def state_part(self) -> ShardedPart:
        return ShardedPart("ssm_state", self.num_v_heads, self.head_v_dim * self.head_k_dim)


def _conv_parts(layout: ConvLayout, rows: int,
                sub_projections: tuple[tuple[str, int, int], ...]) -> tuple[ShardedPart, ...]:
    """The conv state's sharded parts in storage order.

    DS: one part per sub-projection, a unit being one head's (or group's) channels with
    all their rows. SD: each row repeats every sub-projection, so a unit is one head's
    channels in one row, and the parts are `conv_x.0, conv_B.0, conv_C.0, conv_x.1, ...`.
    """
    if layout == "DS":
        return tuple(ShardedPart(name, units, per_unit * rows) for name, units, per_unit in sub_projections)
    return tuple(ShardedPart(f"{name}.{row}", units, per_unit)
                 for row in range(rows) for name, units, per_unit in sub_projections)


def _check_ssm_dims(group: Mamba2 | GDN) -> None:
    """Every dim in [1, MAX_MODEL_DIM]; the conv state keeps `conv_kernel - 1` rows, so >= 2."""
    for name, value in vars(group).items():
        if name == "conv_kernel":
            check(f"{group.kind} conv_kernel", value, int_range(2, MAX_MODEL_DIM))
        elif name == "conv_layout":
            if value not in CONV_LAYOUTS:
                raise ValueError(f"{group.kind} conv_layout must be one of {list(CONV_LAYOUTS)}, got {value!r}")
        elif name == "state_dtype":
            if value != "" and value not in STATE_DTYPES:
                raise ValueError(f"{group.kind} state_dtype must be '' (the model's) or one of "
                                 f"{list(STATE_DTYPES)}, got {value!r}")
        elif name != "kind":
            check(f"{group.kind} {name}", value, MODEL_DIM)
    if group.conv_layout == "SD" and group.conv_kernel > MAX_SD_CONV_KERNEL:
        # Each row of an SD conv state is its own set of parts (and descriptors).
        raise ValueError(f"{group.kind} conv_kernel {group.conv_kernel} with the SD conv layout: at most "
                         f"{MAX_SD_CONV_KERNEL} is supported (models use 2 to 5)")


GroupSpec = FullAttention | SlidingWindow | MLA | Mamba2 | GDN
GROUP_TYPES = (FullAttention, SlidingWindow, MLA, Mamba2, GDN)
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
    `kv_scales[i]` is layer i's (k_scale, v_scale) of a quantized cache: the bytes mean
    value / scale, so a reader with other scales would decode other values. Empty when the
    cache holds the model's own dtype.
    """

    name: str
    num_kv_heads: int
    head_dim: int
    dtype: str
    groups: tuple[GroupSpec, ...]
    layer_groups: tuple[int, ...]
    kv_scales: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        check("num_kv_heads", self.num_kv_heads, MODEL_DIM)
        check("head_dim", self.head_dim, MODEL_DIM)
        # Lists are taken as tuples (the spec is hashed: plans are cached per model).
        for name in ("groups", "layer_groups", "kv_scales"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)):
                raise ValueError(f"{name} must be a tuple, got {type(value).__name__} {value!r}"[:300])
            object.__setattr__(self, name, tuple(value))
        if not self.groups:
            raise ValueError("groups must name at least one group")
        bad_groups = [g for g in self.groups if not isinstance(g, GROUP_TYPES)]
        if bad_groups:
            raise ValueError(f"groups must be group specs ({', '.join(t.__name__ for t in GROUP_TYPES)}), "
                             f"got {bad_groups[:3]!r}"[:300])
        check("number of layers", len(self.layer_groups), MODEL_DIM)
        for i, g in enumerate(self.layer_groups):
            check(f"layer_groups[{i}]", g, int_range(0, len(self.groups) - 1))
        object.__setattr__(self, "layer_groups", tuple(int(g) for g in self.layer_groups))
        object.__setattr__(self, "kv_scales", tuple(
            tuple(pair) if isinstance(pair, (tuple, list)) else pair for pair in self.kv_scales))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} not supported; expected one of {sorted(DTYPE_BYTES)}")
        unused = set(range(len(self.groups))) - set(self.layer_groups)
        if unused:
            raise ValueError(f"groups {sorted(unused)} have no layers")
        if self.kv_scales:
            if len(self.kv_scales) != len(self.layer_groups):
                raise ValueError(f"kv_scales has {len(self.kv_scales)} (k, v) pairs for {len(self.layer_groups)} layers")
            bad_scales = [pair for pair in self.kv_scales
                          if not isinstance(pair, tuple) or len(pair) != 2 or not all(_positive_float(x) for x in pair)]
            if bad_scales:
                raise ValueError(f"kv_scales must be (k, v) pairs of finite positive floats, got {bad_scales[:3]}")

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
        out = {
            "name": self.name,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "groups": [asdict(g) for g in self.groups],
            "layer_groups": list(self.layer_groups),
        }
        if self.kv_scales:  # absent otherwise: unquantized specs keep their compat hash
            out["kv_scales"] = [list(pair) for pair in self.kv_scales]
        return out

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
                kv_scales=tuple(_wire_scale_pair(pair) for pair in data.get("kv_scales", ())),
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


def _positive_float(value: object) -> bool:
    return type(value) is float and math.isfinite(value) and value > 0


def _wire_scale_pair(pair: Any) -> tuple[float, float]:
    if (not isinstance(pair, list | tuple) or len(pair) != 2
            or not all(type(x) in (int, float) for x in pair)):
        raise ValueError(f"malformed model spec: kv_scales entries must be [k_scale, v_scale], got {pair!r}")
    try:
        return float(pair[0]), float(pair[1])
    except OverflowError:
        raise ValueError(f"malformed model spec: kv_scales entry {pair!r} is out of range") from None


def _compat_hash(spec: ModelSpec) -> str:
    blob = json.dumps(spec.to_dict(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# Planning one reader against a wide engine compares the spec once per source rank.
_cached_compat_hash = lru_cache(maxsize=64)(_compat_hash)
