//! Synthetic Criteo-like data.
