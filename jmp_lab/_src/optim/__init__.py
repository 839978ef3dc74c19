"""The optimizer core both jmp_lab optimizers share: the gate (unscale, the
one finite check, the skip), the masters, the states and the argument
checks."""
