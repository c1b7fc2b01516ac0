//go:build !unix

package health

import (
	"testing"
	"time"
)

// processCPU is not measured here: the benchmark reports 0 CPU.
func processCPU(testing.TB) time.Duration { return 0 }
