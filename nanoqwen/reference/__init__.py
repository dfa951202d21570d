"""The NumPy reference: every operation of the forward pass as a plain numpy function (`ops`), and
the backend that chains them into the model on the CPU (`backend.NumpyBackend`). It is the oracle
every CUDA kernel is tested against, and what runs where there is no GPU."""
