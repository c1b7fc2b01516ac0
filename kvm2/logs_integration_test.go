//go:build integration

package kvm2

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// logKeys are the keys a log line of this module may carry: funcr's own
// (logger, level, msg, error for logr's Error argument), the one key set
// (entry, instance, volume, image, elapsed, err) and the facts particular lines
// add. A key outside it, or one twice in a line, fails the test.
var logKeys = []string{
	"logger", "level", "msg", "error", // funcr
	"entry", "instance", "volume", "image", "elapsed", "err", // the key set
	"op", "code", "uid", "domain", "base", "pool", "url", "uri", "bytes", "total", "rate", "bytesPerSecond",
	"sha256", "upload", "uploadBytesPerSecond", "verify", "verifyBytesPerSecond",
	"claims", "final", "address", "user", "dedicated", "reason", "hostname", "libvirtVersion",
	"poolState", "poolFreeGiB", "domainType", "state", "created", "deleted", "heldBeforeReply", "droppedAfterEnd",
	"content_length", "contentLength", "format", "source", "marker", "token", "from", "holder",
}

// TestIntegrationLogCapture runs one successful and one failed Create (and
// the Get and Delete around them) with one JSON logger at V(1) for the
// client and the provider, and checks the conventions: the key set, no key
// twice in a line, elapsed a duration, expected outcomes (NotFound) at
// V(1), the failure someone must act on (an image the mirror does not have)
// at Error. With EGRESSPROXY_LOG_CAPTURE=<file> it writes the lines there
// (docs/logging.md shows such a capture).
func TestIntegrationLogCapture(t *testing.T) {
	e := newLifecycleEnv(t)
	missing := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(missing.Close)
	e.cfg.Images["gone"] = imagecache.Image{URL: missing.URL + "/gone.qcow2"}
	e.cfg.DefaultImage = "tiny"

	var mu sync.Mutex
	var lines []string
	log := funcr.NewJSON(func(obj string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, obj)
	}, funcr.Options{Verbosity: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	p, err := open(ctx, e.cfg, &Options{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	c := driver.NewClient(p, &egressproxy.Options{Logger: log})
	ok := egressproxy.Spec{Name: "logs-ok", UID: "uid-logs-ok", ImageKey: "tiny", MachineType: "tiny"}
	bad := egressproxy.Spec{Name: "logs-bad", UID: "uid-logs-bad", ImageKey: "gone", MachineType: "tiny"}
	if _, err := c.Get(ctx, ok.Ref()); errs.Code(err) != errs.NotFound {
		t.Fatalf("Get before Create: %v", err)
	}
	if _, err := c.Create(ctx, ok); err != nil {
		t.Fatalf("Create: %v", err)
	}
	if _, err := c.Create(ctx, bad); errs.Code(err) != errs.Permanent {
		t.Fatalf("Create of an image the mirror does not have: %v, want Permanent", err)
	}
	if err := c.Delete(ctx, ok.Ref()); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}

	mu.Lock()
	defer mu.Unlock()
	if path := os.Getenv("EGRESSPROXY_LOG_CAPTURE"); path != "" {
		if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var notFoundAtV1, failureAtError bool
	for _, l := range lines {
		keys, obj := jsonKeys(t, l)
		for i, k := range keys {
			if !slices.Contains(logKeys, k) {
				t.Errorf("key %q outside the key set: %s", k, l)
			}
			if slices.Contains(keys[:i], k) {
				t.Errorf("key %q twice: %s", k, l)
			}
		}
		if v, ok := obj["elapsed"]; ok {
			s, _ := v.(string)
			if _, err := time.ParseDuration(s); err != nil {
				t.Errorf("elapsed %v is not a duration: %s", v, l)
			}
		}
		msg, _ := obj["msg"].(string)
		level, _ := obj["level"].(float64)
		_, isError := obj["error"]
		if obj["code"] == "NotFound" {
			notFoundAtV1 = level == 1 && !isError
			if isError {
				t.Errorf("NotFound logged at Error: %s", l)
			}
		}
		if obj["code"] == "Permanent" && obj["instance"] == "logs-bad" && isError && msg == "operation failed" {
			failureAtError = true
		}
	}
	if !notFoundAtV1 {
		t.Error("no V(1) line for the Get that was NotFound")
	}
	if !failureAtError {
		t.Error("no Error line for the Create whose image the mirror does not have")
	}
	t.Logf("%d lines captured", len(lines))
}

// jsonKeys returns the keys of one JSON object in their order, and the
// object.
func jsonKeys(t *testing.T, line string) ([]string, map[string]any) {
	t.Helper()
	var obj map[string]any
	if err := json.Unmarshal([]byte(line), &obj); err != nil {
		t.Fatalf("not JSON: %v: %s", err, line)
	}
	dec := json.NewDecoder(strings.NewReader(line))
	var keys []string
	depth := 0
	expectKey := false
	for {
		tok, err := dec.Token()
		if err != nil {
			break
		}
		switch v := tok.(type) {
		case json.Delim:
			switch v {
			case '{', '[':
				depth++
				expectKey = v == '{' && depth == 1
			case '}', ']':
				depth--
				expectKey = depth == 1
			}
			continue
		case string:
			if depth == 1 && expectKey {
				keys = append(keys, v)
				expectKey = false
				continue
			}
		}
		if depth == 1 {
			expectKey = true
		}
	}
	return keys, obj
}
