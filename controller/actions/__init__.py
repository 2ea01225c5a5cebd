"""What a command does with the stages: provision, certify, seal, wire a workstation, the fleet lock, client settings."""
