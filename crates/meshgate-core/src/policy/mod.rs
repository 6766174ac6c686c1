//! The MutationPolicy engine (being written).
