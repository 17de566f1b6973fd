"""The cluster's node provider for Ray's autoscaler v2: pools are Auto Scaling groups.

It runs on the head, inside the trainer image, in Ray's monitor process. Ray imports it by
name from the autoscaling config (``provider: {type: external, module: ...}``) that infra
renders into the head's user data; nothing else in ``trainer`` imports it.
"""
