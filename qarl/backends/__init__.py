"""Training backends behind one policy interface (`policy.backend`): the Hugging Face model (hf.py) and
megatron-core (megatron_policy.py: the Policy; megatron.py: the tensor-parallel model; convert.py: the
HF <-> Megatron converter)."""
