"""Install clawrl from core/clawrl.

Ranges admit both ends of what we run on: torch 2.11 (the GPU image) to 2.13 (the CPU wheel
CI pins in requirements.txt), and megatron-core 0.16 (newest for Python 3.11) to 0.19.
"""
from setuptools import find_packages, setup

setup(
    name="clawrl",
    version="0.1.0",
    description="Train a self-hosted LLM agent from its own live conversations.",
    package_dir={"": "core"},
    packages=find_packages("core"),
    package_data={"clawrl": ["conf/*.yaml", "embedded/*.jsonl", "envs/gui/*.js"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11,<2.14",
        "transformers>=5.0,<6",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "numpy>=1.26",
        "tqdm>=4.66",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "httpx>=0.27",
        "selenium>=4.5",  # gui-rl drives Chromium (clawrl.envs.gui)
        "miniwob>=1.1,<2",  # its task pages and reward functions
        "psutil>=5.9",
    ],
    extras_require={
        "test": ["pytest>=8", "openai>=1.40", "matplotlib>=3.8"],
        "megatron": ["megatron-core>=0.16,<0.20"],
        "lora": ["peft>=0.12"],
        "wandb": ["wandb>=0.17"],
        "ray": ["ray>=2.9"],
        # clawrl model get/import: read GGUF files, which transformers dequantizes into HF directories
        "models": ["gguf>=0.10"],
        # Triton kernels of hybrid models' linear-attention layers (model.linear_attention); GPU only
        "fla": ["flash-linear-attention==0.6.0", "fla-core==0.6.0", "einops==0.8.1"],
        # CUDA driver/runtime bindings (cuda.bindings); clawrl imports nothing from it (README, Install)
        "cuda": ["cuda-python==13.4.4"],
    },
    entry_points={"console_scripts": ["clawrl=clawrl.cli:main"]},
)
