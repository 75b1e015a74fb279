//! The `vramcap` command: run, demo, doctor, report, plot, export, replay, the size grammar, the GPU check script, the documented queries and the fuzzers' findings.

mod cli_demo;
mod cli_doctor;
mod cli_export;
mod cli_first_hour;
mod cli_grammar;
mod cli_newcomer;
mod cli_replay;
mod cli_report;
mod cli_run;
mod cli_unix;
mod doc_queries;
mod fuzz_regressions;
mod gpu_check_script;
mod replay_policy;
