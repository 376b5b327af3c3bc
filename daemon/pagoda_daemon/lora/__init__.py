"""LoRA adapters served beside the base model: read and checked (adapter.py), named per request
(request.py), given GPU slots by the scheduler (slots.py) and added to the projections of every
step that uses them (layers.py)."""
