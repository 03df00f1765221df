"""hybridmoe: ultra-sparse MoE language models with hybrid KDA/MLA attention, in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name="hybridmoe",
    version="0.1.0",
    description="Ultra-sparse MoE language models with hybrid KDA/MLA attention in JAX/Flax",
    python_requires=">=3.12,<3.13",
    packages=find_packages(include=["hybridmoe", "hybridmoe.*", "pallas_kernels", "pallas_kernels.*",
                                    "experiments", "experiments.*"]),
    install_requires=[
        "jax==0.11.2",
        "jaxlib==0.11.2",
        "flax==0.12.10",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.4",
        "grain==0.2.18",
        "chex==0.1.92",
        "gin-config==0.5.0",
        "absl-py",
        "numpy",
        "matplotlib",
        "tensorboardX",
        "tqdm",
    ],
    extras_require={
        "cuda": ["jax[cuda13]==0.11.2"],
        "test": ["pytest", "pytest-xdist", "hypothesis"],
        "notebooks": ["jupyter"],
    },
)
