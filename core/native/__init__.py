"""Native execution (`apply_plan(..., runtime="native")`), all of it: a plan lowered to
checkpointed regions (`lowering`), simulated as autograd and checkpoint run it (`simulate`),
solved for directly (`solver`, method "native"), and installed on the model (`runtime`, with
`offload`'s saved-tensor hooks and `kv_cache`'s guard). Regions that are no submodule are
stretches of a parent's forward (`stretch`, `replay`) between moments (`boundaries`); the
model's Python lifetimes come from a probe (`lifetimes`); eager's ops are matched to the
trace's in one place (`match`). The package imports nothing itself."""
