package controller

import "testing"

// Without a configured number, Setup reconciles DefaultReconcilesPerEntry
// objects at once per entry (never fewer than the reconciler's own
// default); a configured number is kept as it is.
func TestReconcileWorkers(t *testing.T) {
	for _, tt := range []struct{ configured, entries, want int }{
		{0, 5, 20},
		{0, 50, 200},
		{0, 1, DefaultMaxConcurrentReconciles},
		{0, 0, DefaultMaxConcurrentReconciles},
		{-1, 2, 8},
		{7, 50, 7},
	} {
		if got := reconcileWorkers(tt.configured, tt.entries); got != tt.want {
			t.Errorf("reconcileWorkers(%d, %d entries) = %d, want %d", tt.configured, tt.entries, got, tt.want)
		}
	}
}
