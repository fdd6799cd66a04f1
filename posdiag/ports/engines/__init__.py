"""The engines a candidate can run in, one module each, every one a port (posdiag/ports/protocol.py): in_process
(PyTorch), logits_only (any object with logits(ids), a user's factory's), llama_cpp (+ child_process, llama_child),
onnx_runtime, http_server. Nothing is imported here (the llama.cpp child starts without torch)."""
