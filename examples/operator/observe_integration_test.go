//go:build integration

package operator_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/duration"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// sample is one series of a scrape: a counter's or a gauge's value, or a
// histogram's count (its name then ends in _count).
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// scrape is what one GET of an operator process's /metrics returned.
type scrape struct {
	samples []sample
	text    string
}

// scrapeMetrics reads p's /metrics (the Deployment's metrics port).
func scrapeMetrics(t *testing.T, p *operatorProcess) scrape {
	t.Helper()
	resp, err := http.Get("http://" + p.metrics + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", p.name, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s, %v", p.name, resp.Status, err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("scrape %s: not Prometheus text: %v", p.name, err)
	}
	s := scrape{text: string(body)}
	for name, mf := range mfs {
		for _, m := range mf.GetMetric() {
			smp := sample{name: name, labels: map[string]string{}}
			for _, l := range m.GetLabel() {
				smp.labels[l.GetName()] = l.GetValue()
			}
			switch {
			case m.GetHistogram() != nil:
				smp.name, smp.value = name+"_count", float64(m.GetHistogram().GetSampleCount())
			case m.GetCounter() != nil:
				smp.value = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				smp.value = m.GetGauge().GetValue()
			default:
				continue
			}
			s.samples = append(s.samples, smp)
		}
	}
	return s
}

// sum is the sum of the values of name's series whose labels include
// match, and how many such series there are.
func (s scrape) sum(name string, match map[string]string) (float64, int) {
	var v float64
	n := 0
	for _, smp := range s.samples {
		if smp.name != name {
			continue
		}
		ok := true
		for k, want := range match {
			ok = ok && smp.labels[k] == want
		}
		if ok {
			v += smp.value
			n++
		}
	}
	return v, n
}

// lines are the scrape's lines that start with prefix (for the log).
func (s scrape) lines(prefix string) string {
	var out []string
	for line := range strings.Lines(s.text) {
		if strings.HasPrefix(line, prefix) {
			out = append(out, strings.TrimSuffix(line, "\n"))
		}
	}
	return strings.Join(out, "\n")
}

// hostReady says what is missing for entry's EgressProxyHost to read
// Ready with the facts of a reachable kvm2 entry ("" when nothing is).
func hostReady(ctx context.Context, c client.Client, entry string) string {
	var h v1alpha1.EgressProxyHost
	if err := c.Get(ctx, client.ObjectKey{Name: entry}, &h); err != nil {
		return fmt.Sprintf("host %s: %v", entry, err)
	}
	cond := meta.FindStatusCondition(h.Status.Conditions, v1alpha1.ConditionHostReady)
	if cond == nil || cond.Status != metav1.ConditionTrue || cond.Reason != controller.ReasonReachable {
		return fmt.Sprintf("host %s: Ready %+v", entry, cond)
	}
	d := h.Status.Details
	if d["hostname"] == "" || d["libvirtVersion"] == "" || d["acceleration"] == "" || d["poolState"] != "running" {
		return fmt.Sprintf("host %s: details %v", entry, d)
	}
	cp := h.Status.Capacity
	if cp == nil || cp.PoolAvailable.Value() <= 0 || cp.MemoryAvailable.Value() <= 0 || cp.CPUs <= 0 {
		return fmt.Sprintf("host %s: capacity %+v", entry, cp)
	}
	if lc := h.Status.LastCheckTime; lc == nil || time.Since(lc.Time) > time.Minute {
		return fmt.Sprintf("host %s: last check %v", entry, lc)
	}
	if h.Labels[controller.ManagedByLabel] != controller.ManagedBy {
		return fmt.Sprintf("host %s: labels %v", entry, h.Labels)
	}
	return ""
}

// hostTable is `kubectl get egressproxyhosts` as the apiserver gives it
// to kubectl (the CRD's printer columns, as a meta.k8s.io Table), printed
// as kubectl prints it; and its rows by name, each column by name.
func hostTable(t *testing.T, restCfg *rest.Config) (string, map[string]map[string]string) {
	t.Helper()
	return resourceTable(t, restCfg, "/apis/egressproxy.dev/v1alpha1/egressproxyhosts")
}

// resourceTable is `kubectl get` of the resources at path (under the
// apiserver's URL), as hostTable prints the hosts.
func resourceTable(t *testing.T, restCfg *rest.Config, path string) (string, map[string]map[string]string) {
	t.Helper()
	hc, err := rest.HTTPClientFor(restCfg)
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequest(http.MethodGet, strings.TrimSuffix(restCfg.Host, "/")+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var tbl metav1.Table
	if err := json.NewDecoder(resp.Body).Decode(&tbl); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%s as a Table: %s, %v", path, resp.Status, err)
	}
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 10, 4, 3, ' ', 0) // kubectl's
	var names []string
	var cols []int
	for i, cd := range tbl.ColumnDefinitions {
		if cd.Priority == 0 {
			names = append(names, strings.ToUpper(cd.Name))
			cols = append(cols, i)
		}
	}
	fmt.Fprintln(w, strings.Join(names, "\t"))
	rows := map[string]map[string]string{}
	for _, r := range tbl.Rows {
		row := map[string]string{}
		var cells []string
		for _, i := range cols {
			cell := "<none>"
			switch v := r.Cells[i].(type) {
			case nil:
			case string:
				cell = v
				if tbl.ColumnDefinitions[i].Type == "date" {
					if ts, err := time.Parse(time.RFC3339, v); err == nil {
						cell = duration.HumanDuration(time.Since(ts))
					}
				}
			case float64:
				cell = strconv.FormatFloat(v, 'f', -1, 64)
			default:
				cell = fmt.Sprint(v)
			}
			row[tbl.ColumnDefinitions[i].Name] = cell
			cells = append(cells, cell)
		}
		rows[row["Name"]] = row
		fmt.Fprintln(w, strings.Join(cells, "\t"))
	}
	w.Flush()
	return b.String(), rows
}

// freezeSSHD stops the sshd of the stack in stackDir and its sessions
// (teststack.FreezeSSHD), as the lab's tests and the soak's freeze fault
// do, and returns the function that resumes them, also run at cleanup.
func freezeSSHD(t *testing.T, stackDir string) (thaw func()) {
	t.Helper()
	thaw, _, err := teststack.FreezeSSHD(stackDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(thaw)
	return thaw
}

// logLine is what the test reads of one line of an operator process's log.
type logLine struct {
	TS     string `json:"ts"`
	Level  string `json:"level"`
	Logger string `json:"logger"`
	Msg    string `json:"msg"`
}

// jsonLog parses every line of p's log as one JSON object with an RFC 3339
// time; it returns the lines and the problems (a line that is not JSON,
// or has no such time).
func (p *operatorProcess) jsonLog() ([]logLine, []string) {
	f, err := os.Open(p.log)
	if err != nil {
		return nil, []string{err.Error()}
	}
	defer f.Close()
	var lines []logLine
	var bad []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	for n := 1; sc.Scan(); n++ {
		var l logLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			bad = append(bad, fmt.Sprintf("line %d is not JSON (%v): %.300s", n, err, sc.Text()))
			continue
		}
		if _, err := time.Parse(time.RFC3339Nano, l.TS); err != nil {
			bad = append(bad, fmt.Sprintf("line %d: ts %q is not RFC 3339: %.300s", n, l.TS, sc.Text()))
		}
		lines = append(lines, l)
	}
	if err := sc.Err(); err != nil {
		bad = append(bad, err.Error())
	}
	return lines, bad
}

// checkJSONLogs checks that every line each process wrote is JSON with an
// RFC 3339 time, and that among them are the lines of each stage given in
// want: stage → a message (logger "": any logger) that some line of that
// process has, as "logger: msg prefix".
func checkJSONLogs(t *testing.T, procs []*operatorProcess, want map[*operatorProcess]map[string]string) {
	t.Helper()
	for _, p := range procs {
		lines, bad := p.jsonLog()
		for _, b := range bad {
			t.Errorf("%s's log: %s", p.name, b)
		}
		if len(lines) == 0 {
			t.Errorf("%s wrote no log line", p.name)
		}
		for _, stage := range slices.Sorted(maps.Keys(want[p])) {
			logger, prefix, _ := strings.Cut(want[p][stage], ": ")
			if !slices.ContainsFunc(lines, func(l logLine) bool {
				return (logger == "" || l.Logger == logger) && strings.HasPrefix(l.Msg, prefix)
			}) {
				t.Errorf("%s's JSON log has no %s line (logger %q, message %q…)", p.name, stage, logger, prefix)
			}
		}
		klogLines := 0
		for _, l := range lines {
			if l.Logger == "klog" {
				klogLines++
			}
		}
		t.Logf("%s: %d log lines, every one JSON with an RFC 3339 time; %d of them klog's", p.name, len(lines), klogLines)
	}
}
