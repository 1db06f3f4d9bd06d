"""Pure transfer planning: which bytes of P go to which bytes of D."""
