//! Interception: the three ways in, every family of entry points, lifetimes, initialisation, faults, the ceiling file, the exported symbols, and the real Python clients.

mod arrays;
mod bindings;
mod ceiling;
mod ceiling_live;
mod config_loud;
mod dependencies;
mod dlsym;
mod exports;
mod families;
mod faults;
mod init;
mod intercept;
mod lifetime;
mod lifetimes_ctx;
mod lifetimes_graph;
mod lifetimes_pool;
mod locations;
mod lookups;
mod numba;
mod observe;
mod prefetch;
mod overhead;
mod overhead_attack;
