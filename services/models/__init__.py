"""Model sources: names -> local Hugging Face checkpoint directories."""
