package controller

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/metric"
	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/controller-runtime/pkg/client"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/internal/memhost"
	"github.com/egressproxy/egressproxy/kvm2"
	"github.com/egressproxy/egressproxy/memprovider"
)

// MemoryEntriesKey is the entries file's top-level key that lists entries
// of kind memory (MemoryEntry).
const MemoryEntriesKey = "memoryEntries"

// MemoryEntry is an entry of kind memory: a memprovider whose VMs are
// real loopback CONNECT proxies (memprovider.Options.ServeProxies) and
// whose every call waits CallDelay, a simulated round trip to a
// hypervisor. It is for tests and benchmarks (the scale bench,
// cmd/scale). Without Endpoint the memprovider is in the operator's
// process: its instances end with it, so another replica, or a restart,
// starts with none and creates every object's VM anew. With Endpoint it
// is the entry of that name on a memory host (internal/memhost), another
// process on the same machine: its VMs outlive the operator, as a kvm2
// entry's outlive theirs on the hypervisor, and every replica given the
// endpoint sees the same VMs.
//
//	memoryEntries:
//	- {entry: mem1, callDelay: 50ms}
//	- {entry: mem2, callDelay: 50ms, provisionDelay: 2s}
//	- {entry: mem3, proxyAddress: 192.0.2.1}
//	- {entry: mem4, endpoint: "http://127.0.0.1:7070"}
type MemoryEntry struct {
	// Entry is the entry's name (a lowercase DNS label without "--", as
	// a kvm2 entry's). It may not be the name of a kvm2 entry of the
	// same file. Required.
	Entry string
	// CallDelay is the simulated round trip of every call (a duration
	// with its unit, "50ms"; zero or absent: none).
	CallDelay time.Duration
	// ProvisionDelay is how long a new VM has no address
	// (memprovider.Options.ProvisionDelay; zero or absent: none).
	ProvisionDelay time.Duration
	// ProxyAddress is where its VMs' proxies listen
	// (memprovider.Options.ProxyAddress): an IP address of the
	// operator's host, not unspecified or multicast (zero or absent:
	// 127.0.0.1). One that is not loopback puts the pools' endpoints
	// in an IPv4 or IPv6 EndpointSlice, which kube-proxy programs.
	ProxyAddress netip.Addr
	// Endpoint is the memory host serving the entry, http://HOST:PORT
	// with a loopback HOST (127.0.0.1, [::1] or localhost); empty: the
	// entry is in the operator's process. With an endpoint the delays
	// are the host's (it waits them): callDelay and provisionDelay may
	// not be given beside it.
	Endpoint string
}

// LoadEntriesFile reads an entries file that may list memory entries
// under MemoryEntriesKey besides what LoadEntries reads: the kvm2
// entries, read by LoadEntries (credentials from their Secrets through r),
// and the memory entries. A file with memory entries only has neither
// "entries" nor "credentialsSecrets". Every problem is reported at once,
// each memory entry's as an *egressproxy.FieldError naming its key path
// (memoryEntries[1].callDelay) and line; a memory entry that has a kvm2
// entry's name is one (memoryEntries[0].entry). It also returns the
// file's labels by entry name (LoadEntriesWithLabels), which may name
// memory entries too; a file with memory entries only may have labels.
func LoadEntriesFile(ctx context.Context, r client.Reader, data []byte) ([]kvm2.Config, []MemoryEntry, map[string]map[string]string, error) {
	root, _ := parseRoot(data) // LoadEntries reports a file that does not parse
	key, value, rest := memoryPair(root)
	if key == nil {
		cfgs, labels, err := LoadEntriesWithLabels(ctx, r, data)
		return cfgs, nil, labels, err
	}
	var problems []error
	var mems []MemoryEntry
	if root.Style&yaml.FlowStyle != 0 {
		problems = append(problems, &egressproxy.FieldError{Field: MemoryEntriesKey, Line: key.Line,
			Rule: "needs a file in block style (each top-level key on a line of its own)"})
	} else {
		mems, problems = decodeMemoryEntries(value)
	}
	for _, k := range rest {
		if k.Value == MemoryEntriesKey {
			problems = append(problems, &egressproxy.FieldError{Field: MemoryEntriesKey, Line: k.Line,
				Rule: fmt.Sprintf("is given twice (first on line %d)", key.Line)})
		}
	}
	var cfgs []kvm2.Config
	var labels map[string]map[string]string
	if len(rest) > 0 && root.Style&yaml.FlowStyle == 0 {
		// The other keys are LoadEntries': the memory entries' lines
		// are blanked, so that its errors name the file's own lines.
		names := make([]string, len(mems))
		for i, m := range mems {
			names[i] = m.Entry
		}
		others := blankLines(data, key.Line, nextLine(root, key))
		var err error
		if slices.ContainsFunc(rest, func(k *yaml.Node) bool { return k.Value == "labels" }) &&
			!slices.ContainsFunc(rest, func(k *yaml.Node) bool { return k.Value != "labels" && k.Value != MemoryEntriesKey }) {
			labels, err = memoryLabels(others, names)
		} else {
			cfgs, labels, err = loadEntries(ctx, r, others, names)
		}
		if err != nil {
			problems = append(problems, err)
		}
	}
	if len(rest) == 0 && len(mems) == 0 && len(problems) == 0 {
		problems = append(problems, &egressproxy.FieldError{Field: MemoryEntriesKey, Line: key.Line, Rule: "is empty, and the file has no other entries"})
	}
	for i, m := range mems {
		for j, c := range cfgs {
			if c.Entry == m.Entry {
				problems = append(problems, &egressproxy.FieldError{Field: fmt.Sprintf("%s[%d].entry", MemoryEntriesKey, i), Value: m.Entry,
					Line: memoryEntryLine(value, i), Rule: fmt.Sprintf("is also the name of entries[%d]", j)})
			}
		}
	}
	if err := errors.Join(problems...); err != nil {
		return nil, nil, nil, err
	}
	return cfgs, mems, labels, nil
}

// memoryLabels reads the labels of a file whose other entries are all
// memory entries (named names): data holds only the labels key, every
// other line blanked.
func memoryLabels(data []byte, names []string) (map[string]map[string]string, error) {
	var f struct {
		Labels map[string]map[string]string `json:"labels"`
	}
	if err := sigsyaml.UnmarshalStrict(data, &f); err != nil {
		return nil, &egressproxy.FieldError{Field: "labels", Rule: "want a map of entry names to maps of label keys to values: " + err.Error()}
	}
	problems := checkLabels(f.Labels)
	for _, entry := range slices.Sorted(maps.Keys(f.Labels)) {
		if !slices.Contains(names, entry) {
			problems = append(problems, &egressproxy.FieldError{Field: keyPath("labels", entry), Rule: "is not the name of an entry"})
		}
	}
	if err := errors.Join(problems...); err != nil {
		return nil, err
	}
	return f.Labels, nil
}

// parseRoot is the file's top-level mapping, nil when it is none.
func parseRoot(data []byte) (*yaml.Node, error) {
	var doc yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(data)).Decode(&doc); err != nil {
		return nil, err
	}
	if len(doc.Content) == 0 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, nil
	}
	return doc.Content[0], nil
}

// memoryPair finds the first MemoryEntriesKey of root: its key and value
// nodes, and the keys of root besides it.
func memoryPair(root *yaml.Node) (key, value *yaml.Node, rest []*yaml.Node) {
	if root == nil {
		return nil, nil, nil
	}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k := root.Content[i]
		if key == nil && k.Kind == yaml.ScalarNode && k.Value == MemoryEntriesKey {
			key, value = k, root.Content[i+1]
			continue
		}
		rest = append(rest, k)
	}
	return key, value, rest
}

// nextLine is the line of the top-level key after key, 0 when key is the
// last.
func nextLine(root, key *yaml.Node) int {
	for i := 0; i+2 < len(root.Content); i += 2 {
		if root.Content[i] == key {
			return root.Content[i+2].Line
		}
	}
	return 0
}

// blankLines returns data with the lines from (1-based) up to before
// (0: to the end) emptied; the other lines keep their numbers.
func blankLines(data []byte, from, before int) []byte {
	lines := strings.SplitAfter(string(data), "\n")
	for i := range lines {
		n := i + 1
		if n >= from && (before == 0 || n < before) {
			if strings.HasSuffix(lines[i], "\n") {
				lines[i] = "\n"
			} else {
				lines[i] = ""
			}
		}
	}
	return []byte(strings.Join(lines, ""))
}

// memoryEntryLine is the line of the list's i-th item.
func memoryEntryLine(list *yaml.Node, i int) int {
	if list != nil && i < len(list.Content) {
		return list.Content[i].Line
	}
	return 0
}

// decodeMemoryEntries reads the list strictly: each item a mapping of the
// keys entry, callDelay, provisionDelay, proxyAddress and endpoint
// (without the delays and the proxy address).
func decodeMemoryEntries(list *yaml.Node) ([]MemoryEntry, []error) {
	var problems []error
	bad := func(field string, line int, value, rule string) {
		problems = append(problems, &egressproxy.FieldError{Field: field, Value: value, Line: line, Rule: rule})
	}
	if list.Kind == yaml.ScalarNode && list.Tag == "!!null" {
		return nil, nil
	}
	if list.Kind != yaml.SequenceNode {
		bad(MemoryEntriesKey, list.Line, "", "must be a list of memory entries ({entry: NAME, callDelay: DURATION} or {entry: NAME, endpoint: URL})")
		return nil, problems
	}
	var out []MemoryEntry
	names := map[string]int{}
	for i, item := range list.Content {
		path := fmt.Sprintf("%s[%d]", MemoryEntriesKey, i)
		if item.Kind != yaml.MappingNode {
			bad(path, item.Line, "", "must be a mapping with the keys entry, callDelay, provisionDelay, proxyAddress and endpoint")
			continue
		}
		m, itemProblems := decodeMemoryEntry(path, item)
		problems = append(problems, itemProblems...)
		switch rule := entryNameRule(m.Entry); {
		case rule != "":
			bad(path+".entry", item.Line, m.Entry, rule)
		default:
			if first, dup := names[m.Entry]; dup {
				bad(path+".entry", item.Line, m.Entry, fmt.Sprintf("is also the name of %s[%d]", MemoryEntriesKey, first))
				continue
			}
			names[m.Entry] = i
		}
		out = append(out, m)
	}
	return out, problems
}

// decodeMemoryEntry reads one item of the list, the mapping at path.
func decodeMemoryEntry(path string, item *yaml.Node) (MemoryEntry, []error) {
	var problems []error
	bad := func(field string, line int, value, rule string) {
		problems = append(problems, &egressproxy.FieldError{Field: field, Value: value, Line: line, Rule: rule})
	}
	var m MemoryEntry
	seen := map[string]*yaml.Node{}
	for j := 0; j+1 < len(item.Content); j += 2 {
		k, v := item.Content[j], item.Content[j+1]
		field := path + "." + k.Value
		if seen[k.Value] != nil {
			bad(field, k.Line, "", "is given twice")
			continue
		}
		seen[k.Value] = k
		if v.Kind != yaml.ScalarNode {
			bad(field, v.Line, "", "must be a single value")
			continue
		}
		switch k.Value {
		case "entry":
			m.Entry = v.Value
		case "endpoint":
			if rule := memhost.CheckEndpoint(v.Value); rule != "" {
				bad(field, v.Line, v.Value, rule)
				continue
			}
			m.Endpoint = v.Value
		case "callDelay", "provisionDelay":
			d, err := parseDelay(v.Value)
			if err != "" {
				bad(field, v.Line, v.Value, err)
				continue
			}
			if k.Value == "callDelay" {
				m.CallDelay = d
			} else {
				m.ProvisionDelay = d
			}
		case "proxyAddress":
			a, err := parseProxyAddress(v.Value)
			if err != "" {
				bad(field, v.Line, v.Value, err)
				continue
			}
			m.ProxyAddress = a
		default:
			bad(field, k.Line, "", "is not a key of a memory entry (entry, callDelay, provisionDelay, proxyAddress, endpoint)")
		}
	}
	if seen["endpoint"] != nil {
		for _, key := range []string{"callDelay", "provisionDelay"} {
			if k := seen[key]; k != nil {
				bad(path+"."+key, k.Line, "", "must not be given beside endpoint: the memory host waits its own delays")
			}
		}
		if k := seen["proxyAddress"]; k != nil {
			bad(path+".proxyAddress", k.Line, "", "must not be given beside endpoint: the memory host's proxies listen where it serves them")
		}
	}
	return m, problems
}

// parseDelay reads a delay: a Go duration with its unit, not negative,
// at most a minute (a longer one makes every call time out). The string
// is the rule broken, "" when none.
func parseDelay(s string) (time.Duration, string) {
	d, err := time.ParseDuration(s)
	switch {
	case err != nil:
		return 0, "must be a duration with its unit, such as 50ms"
	case d < 0:
		return 0, "must not be negative"
	case d > time.Minute:
		return 0, "must be at most 1m"
	}
	return d, ""
}

// parseProxyAddress reads a memory entry's proxy address: an IP address
// a proxy can listen on and a client dial. The string is the rule broken,
// "" when none.
func parseProxyAddress(s string) (netip.Addr, string) {
	a, err := netip.ParseAddr(s)
	switch {
	case err != nil || a.Zone() != "":
		return netip.Addr{}, "must be an IP address, such as 192.0.2.1"
	case a.IsUnspecified() || a.IsMulticast():
		return netip.Addr{}, "must be an address of the host, not unspecified or multicast"
	}
	return a.Unmap(), ""
}

// entryNameRule is the rule an entry name breaks, "" when none: a kvm2
// entry's (a lowercase DNS label, no "--").
func entryNameRule(name string) string {
	switch {
	case name == "":
		return "is required"
	case len(validation.IsDNS1123Label(name)) > 0:
		return "must be a lowercase DNS label (1-63 of a-z, 0-9, '-', alphanumeric at both ends)"
	case strings.Contains(name, "--"):
		return `must not contain "--"`
	}
	return ""
}

// MemoryOptions are what OpenMemoryEntries gives every memory entry.
type MemoryOptions struct {
	// Logger and MeterProvider of each entry's client (its series carry
	// egressproxy.entry, as a kvm2 entry's do). Zero: discard, no-op.
	Logger        logr.Logger
	MeterProvider metric.MeterProvider
}

// OpenMemoryEntries opens one client per memory entry into clients (keyed
// by entry name), which must not hold those names yet: a memprovider
// serving its VMs as CONNECT proxies (on 127.0.0.1 or its ProxyAddress),
// or, for an entry with an Endpoint, the client of that entry on the
// memory host there.
func OpenMemoryEntries(mems []MemoryEntry, opts MemoryOptions, clients map[string]*egressproxy.Client) error {
	for _, m := range mems {
		if _, ok := clients[m.Entry]; ok {
			return fmt.Errorf("memory entry %s: an entry of that name is open already", m.Entry)
		}
	}
	for _, m := range mems {
		if m.Endpoint != "" {
			c, err := memhost.NewClient(m.Endpoint, m.Entry, memhost.ClientOptions{Logger: opts.Logger, MeterProvider: opts.MeterProvider})
			if err != nil {
				return fmt.Errorf("memory entry %s: %w", m.Entry, err)
			}
			clients[m.Entry] = c
			continue
		}
		clients[m.Entry] = memprovider.New(&memprovider.Options{
			ServeProxies: true, ProxyAddress: m.ProxyAddress, CallDelay: m.CallDelay, ProvisionDelay: m.ProvisionDelay,
			Entry: m.Entry, Logger: opts.Logger, MeterProvider: opts.MeterProvider,
		})
	}
	return nil
}
