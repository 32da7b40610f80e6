"""TensorRT-LLM backend: checkpoint writers, INT4 packing, TP/PP sharding, validator and CPU reference.

Importing this package imports neither tensorrt_llm nor onnxruntime.
"""
