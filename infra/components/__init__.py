"""Small ComponentResources, one concern each, composed by infra/program.py."""
