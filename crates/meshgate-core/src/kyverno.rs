//! Kyverno ClusterPolicy import (being written).
