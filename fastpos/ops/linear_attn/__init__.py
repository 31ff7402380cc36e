"""Linear attention kernels: dense, recurrent, chunked and fused (Pallas) paths."""
