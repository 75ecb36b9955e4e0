"""Training forms of kvmem's learned memories (issue 45): differentiable PyTorch forwards that compute what
the C++ memories compute, so that parameters trained through them are exactly what kvmem runs."""
