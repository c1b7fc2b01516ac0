package main

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2"

	"github.com/egressproxy/egressproxy/examples/operator/internal/kustomized"
)

// With the Deployment's flags the operator logs one JSON object per line,
// with an RFC 3339 time, and klog's lines (client-go's) go through the same
// logger, behind klog's own verbosity gate.
func TestDeploymentLogsJSON(t *testing.T) {
	_, d, c := deployment(t)
	for flag, want := range map[string]string{"zap-encoder": "json", "zap-time-encoding": "rfc3339nano"} {
		if v, _ := kustomized.Flag(c.Args, flag); v != want {
			t.Errorf("the Deployment passes --%s=%q, want %s", flag, v, want)
		}
	}
	o, err := parseFlags(expandEnv(t, c, d.Namespace), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	o.zap.DestWriter = &buf
	log := newLogger(o)
	t.Cleanup(klog.ClearLogger)

	log.Info("from the operator", "entry", "hv1")
	klog.Infof("attempting to acquire leader lease %s", "egressproxy-system/x")
	klog.V(2).Info("below klog's verbosity")
	log.V(1).Info("below the operator's level")

	var msgs []string
	for line := range strings.Lines(buf.String()) {
		var m struct {
			TS     string `json:"ts"`
			Logger string `json:"logger"`
			Msg    string `json:"msg"`
		}
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Errorf("not a JSON line: %q: %v", line, err)
			continue
		}
		if _, err := time.Parse(time.RFC3339Nano, m.TS); err != nil {
			t.Errorf("ts %q is not RFC 3339: %v", m.TS, err)
		}
		msgs = append(msgs, m.Logger+": "+m.Msg)
	}
	want := []string{": from the operator", "klog: attempting to acquire leader lease egressproxy-system/x"}
	if strings.Join(msgs, "\n") != strings.Join(want, "\n") {
		t.Errorf("logged\n%s\nwant\n%s", strings.Join(msgs, "\n"), strings.Join(want, "\n"))
	}
}
