//! Offline runs from the seed system's YAML configs: the config schema, datasets, and the run
//! itself with its figures.

#![recursion_limit = "256"]

pub mod config;
pub mod dataset;
pub mod offline;
pub mod random_model;
pub mod random_model_v4;
