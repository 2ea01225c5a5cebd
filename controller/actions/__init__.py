"""What a command does with the stages: provision, status, certify, seal, wire a workstation, the fleet lock,
client settings."""
