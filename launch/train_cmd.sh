# Sourced by the launch scripts: sets the array LCA_TRAIN_CMD to the training command, i.e.
# $LCA_TRAIN if set (split on spaces), else lca-train if it is on PATH, else
# "${PYTHON:-python3} -m lca_jax.cli.train".
if [[ -n "${LCA_TRAIN:-}" ]]; then
  read -r -a LCA_TRAIN_CMD <<< "$LCA_TRAIN"
elif command -v lca-train > /dev/null 2>&1; then
  LCA_TRAIN_CMD=(lca-train)
else
  LCA_TRAIN_CMD=("${PYTHON:-python3}" -m lca_jax.cli.train)
fi
