package main

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/kvm2"
)

// fleetConfig is the -config file, decoded and checked.
type fleetConfig struct {
	// Entries are the kvm2 provider entries, one per hypervisor; the fleet
	// is spread over them round-robin.
	Entries []kvm2.Config
	// Spec is the template of every proxy (Name and UID are set here).
	Spec egressproxy.Spec
	// Target is the CONNECT target (host:port) probed through the proxies;
	// the VMs must be able to reach it, and this program the VMs. Empty
	// when the file has none: then only -until created or running work.
	Target string
	// RunningTimeout bounds the wait for Running (default 10m).
	RunningTimeout time.Duration
	// ProgressInterval is how often a cold image fetch prints its progress
	// (default 1s).
	ProgressInterval time.Duration
}

// configFile is the -config file as written. Each entry is kept raw and
// decoded by kvm2.ParseConfig, which reads it strictly and validates it as
// kvm2.Open does, so an entry's errors name its key or Go field.
type configFile struct {
	Entries          []json.RawMessage `json:"entries"`
	Spec             egressproxy.Spec  `json:"spec"`
	Target           string            `json:"target"`
	RunningTimeout   string            `json:"runningTimeout"`
	ProgressInterval string            `json:"progressInterval"`
}

const (
	defaultRunningTimeout   = 10 * time.Minute
	defaultProgressInterval = time.Second
)

// loadConfig reads the -config file (JSON or YAML) and checks all of it,
// reporting every problem at once, each naming its field: the file's own
// keys (an unknown one is an error), every entry (kvm2.ParseConfig; entry
// names must differ), the spec template, and that each entry has the image
// the spec asks for.
func loadConfig(path string) (*fleetConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fail("reading -config: %v", err)
	}
	var f configFile
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return nil, fail("%s: %v", path, err)
	}
	cfg := &fleetConfig{Spec: f.Spec, Target: f.Target, RunningTimeout: defaultRunningTimeout, ProgressInterval: defaultProgressInterval}
	var problems []error
	field := func(name, value, rule string) {
		problems = append(problems, &egressproxy.FieldError{Field: name, Value: value, Rule: rule})
	}
	if len(f.Entries) == 0 {
		field("entries", "", "want at least one kvm2 entry (one per hypervisor; docs/config.md)")
	}
	seen := map[string]int{}
	for i, raw := range f.Entries {
		c, err := kvm2.ParseConfig(raw)
		if err != nil {
			name := entryName(raw)
			if name != "" {
				name = " (" + errs.Quote(name) + ")"
			}
			fes := egressproxy.FieldErrors(err)
			if len(fes) == 0 {
				problems = append(problems, fmt.Errorf("entries[%d]%s: %w", i, name, err))
			}
			for _, fe := range fes {
				problems = append(problems, fmt.Errorf("entries[%d]%s: %w", i, name, fe))
			}
			continue
		}
		if j, dup := seen[c.Entry]; dup {
			field(fmt.Sprintf("entries[%d].entry", i), c.Entry, fmt.Sprintf("also the name of entries[%d]; every entry needs its own name", j))
		}
		seen[c.Entry] = i
		if rule := imageRule(c, f.Spec.ImageKey); rule != "" {
			field(fmt.Sprintf("entries[%d].images", i), "", fmt.Sprintf("entry %s %s", c.Entry, rule))
		}
		cfg.Entries = append(cfg.Entries, c)
	}
	if f.Spec.Name != "" || f.Spec.UID != "" {
		field("spec", "", "name and uid are set by simple-fleet (fleet-N and a per-run UID); leave them out")
	}
	s := f.Spec
	s.Name, s.UID = "fleet-1", "simple-fleet-check-1"
	for _, fe := range egressproxy.FieldErrors(s.Validate()) {
		field("spec."+fe.Field, fe.Value, fe.Rule)
	}
	if f.Target != "" {
		if host, port, err := net.SplitHostPort(f.Target); err != nil || host == "" || port == "" {
			field("target", f.Target, "want the host:port the proxies should CONNECT to (reachable from the VMs), e.g. example.com:443")
		}
	}
	for _, d := range []struct {
		name, value string
		to          *time.Duration
	}{{"runningTimeout", f.RunningTimeout, &cfg.RunningTimeout}, {"progressInterval", f.ProgressInterval, &cfg.ProgressInterval}} {
		if d.value == "" {
			continue
		}
		v, err := time.ParseDuration(d.value)
		if err != nil || v <= 0 {
			field(d.name, d.value, `want a positive duration like "10m" or "500ms"`)
			continue
		}
		*d.to = v
	}
	switch len(problems) {
	case 0:
	case 1:
		return nil, fail("%s: %v", path, problems[0])
	default: // one problem per line
		msgs := make([]string, len(problems))
		for i, e := range problems {
			msgs[i] = "\n  " + e.Error()
		}
		return nil, fail("%s: %d problems:%s", path, len(problems), strings.Join(msgs, ""))
	}
	return cfg, nil
}

// imageRule says what is wrong with entry c for a spec asking for image
// key ("" : the entry's default), or "" when c can resolve it.
func imageRule(c kvm2.Config, key string) string {
	switch {
	case len(c.Images) == 0:
		return "has no images; Create needs the one spec.imageKey names (or the entry's only one)"
	case key != "":
		if _, ok := c.Images[key]; !ok {
			return fmt.Sprintf("has no image %s (spec.imageKey)", errs.Quote(key))
		}
	case c.DefaultImage == "" && len(c.Images) > 1:
		return "has several images and no defaultImage; set spec.imageKey or defaultImage"
	}
	return ""
}

// entryName is the "entry" key of an entry that did not parse, for the
// message, or "".
func entryName(raw json.RawMessage) string {
	var e struct {
		Entry string `json:"entry"`
	}
	if json.Unmarshal(raw, &e) != nil {
		return ""
	}
	return e.Entry
}
