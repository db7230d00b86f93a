//! Offline runs from the seed system's YAML configs: the config schema, datasets, and the run
//! itself with its figures.

pub mod config;
pub mod dataset;
pub mod offline;
pub mod random_model;
