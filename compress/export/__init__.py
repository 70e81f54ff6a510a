"""The exports: the checkpoint in the formats engines serve (docs/formats.md).

This package owns each format's writer (`hf.py`: Hugging Face safetensors, auto-round's packed format or
dequantized; `onnx.py`: ONNX with MatMulNBits; `genai.py`: ONNX Runtime GenAI's builder; `openvino.py`: OpenVINO
IR), their registrations and plan-time checks (`stage.py`), an `hf` export run on our own kernels (`runtime.py`)
and `compress inspect` (`inspect.py`).
"""
