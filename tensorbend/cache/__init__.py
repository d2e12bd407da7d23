"""What the expert cache DECIDES, as pure Python: no threads, tensors or clock.

`offload/` drives it with the wall clock, threads and real bytes; `simulate/` drives it in
event time. Modules (one concept each) are listed in their own docstrings.
"""
