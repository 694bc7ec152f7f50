"""lca_jax/perf/xla_profile.py: the op table of a train step's HLO and its per-step sums."""

from lca_jax.perf import xla_profile

HLO = """HloModule m

%body.1 (p: (s32[], f32[2,64,64])) -> (s32[], f32[2,64,64]) {
  %p = (s32[], f32[2,64,64]{2,1,0}) parameter(0)
  %exp.1 = f32[2,64,64]{2,1,0} exponential(%x), metadata={op_name="jit(step)/jvp(ByteLM)/ByteLM.encode/encoder/layer_0/attn/exp"}
  %add.2 = f32[2,64,64]{2,1,0} add(%x, %y), metadata={op_name="jit(step)/transpose(jvp(ByteLM))/ByteLM.encode/encoder/layer_0/attn/add"}
  %ynn_fusion.3 = f32[2,64,64]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%fc.3
}

ENTRY %main.9 (a: f32[4096,256]) -> f32[4096,256] {
  %a = f32[4096,256]{1,0} parameter(0)
  %fusion.4 = f32[4096,1024]{1,0} fusion(%a, %w), kind=kCustom, calls=%fc.4, metadata={op_name="jit(step)/jvp(ByteLM)/ByteLM.latent/lm/layer_1/mlp/up_proj/dot_general"}
  %fusion.5 = f32[4096,256]{1,0} fusion(%a), kind=kLoop, calls=%fc.5, metadata={op_name="jit(step)/jvp(ByteLM)/ByteLM.next_byte/decoder/layer_0/attn/q_proj/dot_general"}
  %while.6 = (s32[], f32[2,64,64]{2,1,0}) while(%t), condition=%cond.1, body=%body.1, metadata={op_name="jit(step)/jvp(ByteLM)/ByteLM.encode/encoder/layer_0/attn/while"}
  %all-reduce.7 = f32[256]{0} all-reduce(%g), replica_groups={{0,1}}, to_apply=%add
  %copy.8 = f32[4096,256]{1,0} copy(%a)
}
"""


def test_op_table_kinds_parts_stages():
  t = xla_profile.train_op_table(HLO)
  assert "a" not in t and "p" not in t  # parameters cost nothing
  assert t["fusion.4"] == xla_profile.Op("fusion_custom", "mlp", "latent_lm")
  assert t["fusion.5"] == xla_profile.Op("fusion_loop", "attention_proj", "decoder")
  assert t["while.6"] == xla_profile.Op("loop", "attention_loops", "encoder")
  assert t["exp.1"].part == "attention_loops" and t["exp.1"].stage == "encoder"
  # no source name: the part and stage of its computation's named ops
  assert t["ynn_fusion.3"] == xla_profile.Op("fusion_custom", "attention_loops", "encoder")
  assert t["all-reduce.7"] == xla_profile.Op("collective", "other", "other")
  assert t["copy.8"].kind == "copy"


def test_summarize_leaves_loops_out_of_the_sums():
  t = xla_profile.train_op_table(HLO)
  ns = {"fusion.4": 4e9, "exp.1": 1e9, "ynn_fusion.3": 1e9, "while.6": 3e9}
  s = xla_profile.summarize(ns, t, steps=2)
  assert s["thread_s_per_step"] == 3.0 and s["loop_s_per_step"] == 1.5
  assert s["by_part"] == {"mlp": 2.0, "attention_loops": 1.0}
  assert s["by_stage"] == {"latent_lm": 2.0, "encoder": 1.0}
  assert s["by_kind"] == {"fusion_custom": 2.5, "exponential": 0.5}
