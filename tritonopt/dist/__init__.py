"""``torch.distributed`` layers of tritonopt (KAISA, DHO2, SSD-SGD, DSP, sharded S-MFAC).

None is available yet; this package holds them as they land. Every layer uses
``torch.distributed`` collectives only (NCCL on GPU, gloo on CPU), documents the
collectives it issues and what each rank holds, and counts the bytes it sends.
"""

__all__: list[str] = []
