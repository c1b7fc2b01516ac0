package health

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"go.opentelemetry.io/otel/trace/noop"
	"sigs.k8s.io/yaml"
)

// The option structs marshal their plain values (camelCase, durations as
// strings); the collaborators (funcs, dialer, TLS config, logger, tracer)
// and the proxy password are never marshalled, so options holding them
// marshal at all and print no secret.
func TestOptionsJSON(t *testing.T) {
	t.Parallel()
	const password = "pr0xy-passw0rd"
	opts := ProbeAllOptions{
		Workers:    8,
		TargetAddr: "example.com:443",
		Probe: ProbeOptions{
			Timeout:  3 * time.Second,
			Username: "probe",
			Password: password,
			TLS:      &tls.Config{},
			Exchange: func(context.Context, net.Conn) error { return nil },
			Dialer:   &net.Dialer{},
		},
		Logger:         logr.Discard(),
		TracerProvider: noop.NewTracerProvider(),
	}
	b, err := json.Marshal(opts)
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"workers":8,"targetAddr":"example.com:443","probe":{"timeout":"3s","username":"probe"}}`
	if string(b) != want {
		t.Errorf("ProbeAllOptions = %s\nwant %s", b, want)
	}
	y, err := yaml.Marshal(opts)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), password) || strings.Contains(string(y), password) {
		t.Errorf("password marshalled:\n%s\n%s", b, y)
	}
	var got ProbeAllOptions
	if err := yaml.UnmarshalStrict(y, &got); err != nil {
		t.Fatalf("%s: %v", y, err)
	}
	wantBack := ProbeAllOptions{Workers: 8, TargetAddr: "example.com:443", Probe: ProbeOptions{Timeout: 3 * time.Second, Username: "probe"}}
	if d := cmp.Diff(wantBack, got, cmpopts.IgnoreUnexported(logr.Logger{})); d != "" {
		t.Errorf("round trip (-want +got):\n%s", d)
	}

	tr := TrackerOptions{Rise: 2, Fall: 3, Grace: 90 * time.Second, OnForget: func(Status) {}, Now: time.Now, Logger: logr.Discard(), TracerProvider: noop.NewTracerProvider()}
	b, err = json.Marshal(tr)
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"rise":2,"fall":3,"grace":"1m30s"}`; string(b) != want {
		t.Errorf("TrackerOptions = %s, want %s", b, want)
	}
	var gotTr TrackerOptions
	if err := yaml.UnmarshalStrict([]byte("rise: 2\nfall: 3\ngrace: 90s\n"), &gotTr); err != nil || gotTr.Rise != 2 || gotTr.Fall != 3 || gotTr.Grace != 90*time.Second {
		t.Errorf("TrackerOptions from YAML = %+v, %v", gotTr, err)
	}
	// Zero values mean the defaults and are left out.
	if b, _ := json.Marshal(TrackerOptions{}); string(b) != `{}` {
		t.Errorf("zero TrackerOptions = %s", b)
	}
	// A bare number is refused, naming the field.
	err = yaml.UnmarshalStrict([]byte("grace: 90\n"), &gotTr)
	if err == nil || !strings.Contains(err.Error(), "TrackerOptions.grace") || !strings.Contains(err.Error(), "nanoseconds") {
		t.Errorf("bare number: %v", err)
	}
}

// The option structs holding the proxy password print without it, through
// String and every fmt verb, by value and by pointer (an embedder logging
// its options, or a %+v in an error, must not leak the Secret), and still
// show the plain values.
func TestOptionsTextHasNoSecret(t *testing.T) {
	t.Parallel()
	const password = "pr0xy-passw0rd"
	probe := ProbeOptions{Timeout: 3 * time.Second, Username: "probe", Password: password, Dialer: &net.Dialer{}}
	all := ProbeAllOptions{Workers: 8, TargetAddr: "example.com:443", Probe: probe, Logger: logr.Discard()}
	for name, v := range map[string]any{"ProbeOptions": probe, "*ProbeOptions": &probe, "ProbeAllOptions": all, "*ProbeAllOptions": &all} {
		for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q"} {
			out := fmt.Sprintf(verb, v)
			if strings.Contains(out, password) {
				t.Errorf("%s with %s shows the password: %s", name, verb, out)
			}
			if !strings.Contains(out, "probe") || !strings.Contains(out, "3s") {
				t.Errorf("%s with %s lacks the username or timeout: %s", name, verb, out)
			}
		}
	}
	if s := probe.String(); s != `{"timeout":"3s","username":"probe"}` {
		t.Errorf("ProbeOptions.String() = %s", s)
	}
	if s := all.String(); s != `{"workers":8,"targetAddr":"example.com:443","probe":{"timeout":"3s","username":"probe"}}` {
		t.Errorf("ProbeAllOptions.String() = %s", s)
	}
}
