"""The train-step core both steps (linen's ``jmp_lab.train_step`` and
``jmp_lab.nnx.train_step``) are thin on."""
