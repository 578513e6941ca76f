"""Device kernels (Triton) behind the zoo's own ops; each has a torch fallback in its caller."""
