//go:build integration

package kvm2

import (
	"context"
	"testing"

	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy/internal/teststack"
	"github.com/egressproxy/egressproxy/provider"
	"github.com/egressproxy/egressproxy/provider/providertest"
)

// kvm2Harness gives each conformance subtest a fresh entry (and base, and
// isolated network) on the real stack; a second entry shares host and pool.
type kvm2Harness struct {
	t *testing.T
	e *lifecycleEnv
}

func (h *kvm2Harness) MakeProvider(ctx context.Context) (provider.Provider, error) {
	return Open(ctx, h.e.cfg, &Options{Logger: testr.New(h.t)})
}

func (h *kvm2Harness) MakeOtherEntryProvider(ctx context.Context) (provider.Provider, error) {
	cfg := h.e.cfg
	cfg.Entry += "-o" // contains the first entry's name, so the env's cleanup covers it
	return Open(ctx, cfg, &Options{Logger: testr.New(h.t)})
}

func (h *kvm2Harness) Close() {}

func TestIntegrationConformance(t *testing.T) {
	teststack.Require(t)
	providertest.RunConformanceTests(t, func(ctx context.Context, t *testing.T) (providertest.Harness, error) {
		return &kvm2Harness{t: t, e: newLifecycleEnv(t)}, nil
	}, &providertest.Options{
		NamePrefix:   "pt",
		NeverRunning: true, // the test guests have no OS, so never an address
		// The template leaves ImageKey and MachineType empty (the entry's
		// defaults); naming the default explicitly is another spec.
		OtherImageKey:    "tiny",
		OtherMachineType: "tiny",
	})
}
