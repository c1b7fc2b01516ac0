package drivertest

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/naming"
	"go.uber.org/goleak"
)

// The suite itself is exercised by memprovider's tests (which run it on a
// correct provider and on broken variants); these test its parts.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type reporter struct{ msgs []string }

func (r *reporter) Errorf(format string, args ...any) {
	r.msgs = append(r.msgs, fmt.Sprintf(format, args...))
}

func TestWatchdog(t *testing.T) {
	tests := []struct {
		name     string
		budget   time.Duration
		work     time.Duration
		exceeded bool
	}{
		{"within budget", time.Minute, 0, false},
		{"budget exceeded", 10 * time.Millisecond, 100 * time.Millisecond, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var cancelled atomic.Bool
			w := startWatchdog(t.Name(), tt.budget, time.Minute, func() { cancelled.Store(true) })
			time.Sleep(tt.work)
			var r reporter
			w.finish(&r)
			if cancelled.Load() != tt.exceeded {
				t.Errorf("context cancelled = %v, want %v", cancelled.Load(), tt.exceeded)
			}
			if got := len(r.msgs) > 0; got != tt.exceeded {
				t.Fatalf("reported %v, want exceeded=%v", r.msgs, tt.exceeded)
			}
			if tt.exceeded && !strings.Contains(r.msgs[0], "exceeded its budget of 10ms") {
				t.Errorf("message %q does not name the budget", r.msgs[0])
			}
		})
	}
}

func TestInstanceProblems(t *testing.T) {
	ref := egressproxy.Ref{Name: "a", UID: "u"}
	ok := egressproxy.Instance{Ref: ref, CreatedAt: time.Now(), State: egressproxy.StateRunning, IP: "127.0.0.1", Port: 3128, AddressSource: "static"}
	tests := []struct {
		name      string
		mutate    func(*egressproxy.Instance)
		addresses bool
		want      string // "" = no problem
	}{
		{"valid running", func(*egressproxy.Instance) {}, true, ""},
		{"valid provisioning", func(i *egressproxy.Instance) {
			i.State = egressproxy.StateProvisioning
			i.IP = ""
			i.AddressSource = ""
		}, true, ""},
		{"wrong name", func(i *egressproxy.Instance) { i.Name = "b" }, true, "Name"},
		{"wrong UID", func(i *egressproxy.Instance) { i.UID = "v" }, true, "UID"},
		{"zero CreatedAt", func(i *egressproxy.Instance) { i.CreatedAt = time.Time{} }, true, "CreatedAt is zero"},
		{"far-future CreatedAt", func(i *egressproxy.Instance) { i.CreatedAt = time.Now().Add(48 * time.Hour) }, true, "plausible"},
		{"unknown state", func(i *egressproxy.Instance) { i.State = "Booting" }, true, "four states"},
		{"provisioning with IP", func(i *egressproxy.Instance) { i.State = egressproxy.StateProvisioning }, true, "Provisioning instance has IP"},
		{"source without IP", func(i *egressproxy.Instance) { i.State = egressproxy.StateStopped; i.IP = "" }, true, "AddressSource"},
		{"bad IP", func(i *egressproxy.Instance) { i.IP = "not-an-ip" }, true, "not an IP"},
		{"bad port", func(i *egressproxy.Instance) { i.Port = 0 }, true, "Port 0"},
		{"running without IP", func(i *egressproxy.Instance) { i.IP = ""; i.AddressSource = "" }, true, "Running instance has no IP"},
		{"running without IP in List", func(i *egressproxy.Instance) { i.IP = ""; i.AddressSource = "" }, false, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			inst := ok
			tt.mutate(&inst)
			got := strings.Join(instanceProblems(inst, ref, tt.addresses), "; ")
			if tt.want == "" && got != "" || tt.want != "" && !strings.Contains(got, tt.want) {
				t.Fatalf("problems = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestOptionsDefaults(t *testing.T) {
	o := (*Options)(nil).withDefaults()
	if o.NamePrefix != "pt" || o.RunningTimeout != 2*time.Minute || o.SubtestBudget != 3*time.Minute || o.Grace != 15*time.Second || o.Concurrency != 4 || o.PollInterval <= 0 {
		t.Fatalf("defaults: %+v", o)
	}
	o = (&Options{RunningTimeout: time.Second}).withDefaults()
	if o.SubtestBudget != time.Second+time.Minute {
		t.Fatalf("SubtestBudget default does not follow RunningTimeout: %v", o.SubtestBudget)
	}
}

func TestRandomSuffixIsAValidNamePart(t *testing.T) {
	for range 100 {
		if err := naming.ValidateName("Name", "pt-"+randomSuffix(5)+"-a"); err != nil {
			t.Fatal(err)
		}
	}
}
