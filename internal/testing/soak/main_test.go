package soak

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// childMain, set by the integration build, is the soak's driver process:
// TestSoak re-executes this test binary with EGRESSPROXY_SOAK_DRIVER set
// (driver_integration_test.go).
var childMain func() int

func TestMain(m *testing.M) {
	if os.Getenv("EGRESSPROXY_SOAK_DRIVER") != "" && childMain != nil {
		os.Exit(childMain())
	}
	goleak.VerifyTestMain(m)
}
