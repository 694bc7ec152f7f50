"""Training and decoding throughput of the paper's PyTorch code vs lca-jax, same model, one run.

    python tools/bench_vs_upstream.py train --upstream-src /tmp/upstream \
        [--shapes 4x1024,1x4096] [--steps 10] [--rounds 2] [--warmup 2] \
        [--d-model 256 --d-inner 1024 --n-heads 4 --layers 2,4,2,2] [--max-latent-ratio 0] \
        [--data FILE.txt]
    python tools/bench_vs_upstream.py decode --upstream-src /tmp/upstream \
        [--sizes 11m,60m,374m] [--prompt-bytes 256] [--new-bytes 128] [--temperature 0.99]

``--upstream-src`` is a checkout of the paper's code (the folder holding ``src/model/modern_fxt.py``);
it is imported at run time, nothing of it lives in this repository. For each shape ``BxT`` (rows x
bytes) both sides train on the same rows of real text (the bundled demo corpus, or ``--data``, as
byte ids of lca_jax.vocab = the ByT5 ids upstream uses, documents ending with EOS), in ``--rounds``
alternating blocks of ``--steps`` timed steps per side (``bench_pair``: a slow spell of a shared
machine falls on both sides, each timed in its steady state):

  * upstream: ``FxTTransformerLM`` built from ``config_to_upstream(ModelConfig)`` (a plain object
    with one attribute per key, as src/eval/model_loader.py does), float32, train mode, eager;
    step = ``model(batch, task="LM", script_id=259)`` (the first key of ``id_to_script``, as
    src/train/train.py does), loss + mtp_loss + 10 * loss_boundaries[0] (train.py's weights with
    scale_loss2 1 and scale_bp 10), zero_grad / backward / clip_grad_norm_(--clip) / Adam step;
    torch uses all CPU cores.
  * lca_jax: the same shape as a configs/lca_mbp.py config with ``--config.x.y=v`` overrides
    (printed as ``lca_train_overrides``), float32, lambdas 1/1/10, Adam with the same clip and the
    same constant learning rate (no warmup);
    ``loop.prepare`` / ``setup.init_state`` / ``setup.train_step(state, setup.device_batch(b))``
    exactly as lca-train, on the same mesh (a CPU host split in two runs B rows data-parallel
    when they divide, else splits heads and MLP; other hosts use gcd(devices, B) devices).

This program starts as lca-train starts (``lca_jax/hostmem.py``: large host buffers on
transparent huge pages where the kernel's THP mode is ``madvise``, by a glibc tunable set at
start). ``--upstream-env own`` (default) runs the paper's code in a child process with the
environment this program was started with, as its users run it (``UpstreamProcess``: it
answers one step at a time and times it itself; only one side runs at a time);
``--upstream-env same`` runs it in this process, sharing lca_jax's allocator setting.
``machine`` prints ``thp_mode`` and ``glibc_tunables``, ``upstream_env`` the mode and the
paper's side's ``glibc_tunables``. ``--warmup`` steps are not timed (for lca_jax the first one
compiles: ``compile_s``). Prints one JSON object: per shape the bytes/s and seconds per optimizer step of
both sides (median over the timed steps of all rounds; every step in ``step_s_all``), ``ratio``
= lca_jax bytes/s / upstream bytes/s, and the median and range of the rounds' ratios
(``ratio_rounds_median``, ``ratio_rounds_range``), plus machine info, model shape and the parameter
counts of both sides (equal once lca_jax's vocabulary padding rows are removed).

``decode``: for each size of ``--sizes`` (``11m`` = d 256 / inner 1024 / 4 heads / layers
2,4,2,2; ``60m`` = d 512 / 2048 / 8 heads / 2,8,2,2; ``374m`` = configs/lca_mbp.py's shape,
d 1024 / 4096 / 8 heads / 2,16,2,2; or ``dD:INNER:HEADS[:KV]:ENC,LM,DEC,MBP``, e.g.
``d64:128:4:1,1,1,1``), random lca_jax weights (``init_params``, ``--seed``; configs/lca_mbp.py
in float32) are written in the paper's checkpoint layout (``interop.upstream.write_dir``) and
loaded by both sides: upstream's ``FxTTransformerLM`` from that config.json with a strict
``load_state_dict`` (as src/eval/generate.py loads a checkpoint; eval mode, float32), lca_jax
through the converter (``interop.upstream.load_dir``, embedding and head padded to its 384
rows). Both continue the same ``--prompt-bytes`` prompt of real text (the
bundled corpus, ``lca_jax.bench.models.prompt_ids``) by ``--new-bytes`` bytes, batch 1, sampling at
``--temperature`` 0.99 with a fixed seed (upstream's temperature 1.0 is its greedy path, which
stops early on the repetitive output of random weights):

  * upstream: ``generate_group_cached(ids, max_tokens=new_bytes, temperature=T,
    threshold=2.0, candidates=1)``, its KV-cached decoding; threshold 2 accepts no MBP
    candidate, so it commits one NT byte per step (the output of ntp), though it still runs
    its MBP stage every step (its cached path has no NT-only mode for an LCA-MBP model). One
    untimed call of a few bytes first.
  * lca_jax: ``generate(mode="ntp", temperature=T, ignore_eos=True, seed=seed)``; one untimed
    call first (it compiles: ``compile_s``), best of ``--repeats``.

Per size: parameter counts, bytes/s and ms per step of both sides, ``ratio`` = lca_jax /
upstream bytes/s, and the weight-streaming bound of lca_jax's step (``lca_jax.perf.bounds``,
the same bandwidth measurement and formula as tools/bench_decode.py, with a matrix of that
size's float32 parameters unless ``--stream-mb`` is given: per size ``stream_gb_s`` of the
jax device, ``bound_ms_per_step``, ``ms_per_step_over_bound``).

Bad input is reported in one line on stderr with exit status 2.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # lca_jax from this checkout, installed or not
  sys.path.insert(0, ROOT)

from lca_jax import hostmem  # noqa: E402
from lca_jax.bench import args as bargs  # noqa: E402
from lca_jax.bench import models as bench_decode  # noqa: E402,F401  (prompts, model shapes)
from lca_jax.bench import report, upstream  # noqa: E402
from lca_jax.bench.args import BenchError, parse_layers  # noqa: E402,F401
from lca_jax.bench.models import SHAPE_DEFAULTS  # noqa: E402
from lca_jax.bench.upstream_decode import (  # noqa: E402,F401
  SIZES,
  decode_model_config,
  lca_decode,
  load_lca_dir,
  parse_sizes,
  run_decode,
  write_random_dir,
)
from lca_jax.bench.upstream_side import UpstreamProcess  # noqa: E402,F401
from lca_jax.bench.upstream_train import PROG, lca_config, parse_shapes, run_train  # noqa: E402,F401


def _parser():
  ap = bargs.one_line_parser(PROG, description=__doc__.split("\n\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True, metavar="{train,decode}")
  tr = sub.add_parser("train", help="training throughput (bytes/s, s per optimizer step)")
  upstream.add_upstream_src_arg(tr)
  tr.add_argument("--shapes", default="4x1024,1x4096", help="ROWSxBYTES per step, comma separated")
  tr.add_argument(
    "--steps", type=int, default=10, help="timed optimizer steps per side, shape and round"
  )
  tr.add_argument(
    "--rounds", type=int, default=2, help="alternating blocks of --steps steps per side (>= 1)"
  )
  tr.add_argument(
    "--warmup", type=int, default=2, help="untimed steps first (>= 1; lca_jax compiles)"
  )
  bargs.add_shape_args(tr, **SHAPE_DEFAULTS)
  tr.add_argument(
    "--max-latent-ratio",
    type=float,
    default=0.0,
    help="lca_jax's static latent capacity per byte (0 = auto from the boundary "
    "prior, ModelConfig.latent_ratio; configs/lca_mbp.py's default)",
  )
  tr.add_argument("--dropout", type=float, default=0.0)
  tr.add_argument(
    "--clip", type=float, default=0.25, help="global grad-norm clip, both sides (0 = off)"
  )
  tr.add_argument("--lr", type=float, default=3e-4)
  tr.add_argument("--seed", type=int, default=0)
  tr.add_argument(
    "--upstream-env",
    default="own",
    choices=("own", "same"),
    help="own: the paper's code in a child process with the environment this program was "
    "started with (as its users run it); same: in this process, sharing the allocator "
    "setting lca_jax starts with (lca_jax/hostmem.py)",
  )
  tr.add_argument(
    "--data",
    default="",
    metavar="FILE",
    help="local text file(s), comma separated (default: the bundled demo corpus)",
  )
  upstream.add_torch_device_arg(tr)
  de = sub.add_parser("decode", help="decoding throughput (bytes/s, ms per step, bound)")
  upstream.add_upstream_src_arg(de)
  de.add_argument(
    "--sizes",
    default="11m,60m,374m",
    help=f"comma separated: {', '.join(SIZES)} or dD:INNER:HEADS[:KV]:ENC,LM,DEC,MBP",
  )
  de.add_argument("--prompt-bytes", type=int, default=256, help="prompt of real text, bytes")
  de.add_argument("--new-bytes", type=int, default=128, help="bytes generated per call")
  de.add_argument(
    "--temperature",
    type=float,
    default=0.99,
    help="sampling temperature, both sides (upstream's 1.0 is its greedy path)",
  )
  de.add_argument("--seed", type=int, default=0, help="random weights and sampling seed")
  de.add_argument("--repeats", type=int, default=2, help="timed lca_jax calls (best counts)")
  de.add_argument(
    "--stream-mb",
    type=float,
    default=0.0,
    help="W of the bandwidth matvec, MB (0 = each size's float32 parameters, at least 16 MB)",
  )
  de.add_argument("--stream-repeats", type=int, default=5)
  de.add_argument(
    "--torch-threads",
    type=int,
    default=0,
    help="torch CPU threads (0 = all cores, as train uses; on a busy machine 1 can be faster)",
  )
  upstream.add_torch_device_arg(de)
  return ap


def main(argv=None):
  args = _parser().parse_args(argv)
  try:
    out = run_decode(args) if args.cmd == "decode" else run_train(args)
  except BenchError as e:
    sys.exit(report.error(PROG, e))
  return report.print_json(out)


if __name__ == "__main__":
  hostmem.use_huge_pages()  # as lca-train runs (the paper's side: --upstream-env)
  main()
