"""Training backends behind one policy interface: the Hugging Face model (qarl/policy.py) and
megatron-core (megatron.py, with the HF <-> Megatron converter in convert.py)."""
