package main

import (
	"fmt"
	"net"
	"os"
	"strings"
	"time"

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

// configFile is the -config file's own keys; kvm2.ParseEntries reads
// them as it reads the entries beside them (strictly, durations as
// strings).
type configFile struct {
	Spec             specFile      `json:"spec"`
	Target           string        `json:"target"`
	RunningTimeout   time.Duration `json:"runningTimeout"`
	ProgressInterval time.Duration `json:"progressInterval"`
}

// specFile is the spec template as written: the fields of
// egressproxy.Spec a file sets (simple-fleet sets Name and UID).
type specFile struct {
	ImageKey    string `json:"imageKey"`
	MachineType string `json:"machineType"`
	Port        int    `json:"port"`
	UserData    string `json:"userData"`
}

const (
	defaultRunningTimeout   = 10 * time.Minute
	defaultProgressInterval = time.Second
)

// loadConfig reads the -config file (JSON or YAML) and checks all of it,
// reporting every problem at once, each naming its key path: the file and
// its entries (kvm2.ParseEntries: each entry's problems with its index
// and line, unknown keys, entry names that repeat), the spec template,
// the target and durations, and that each entry has the image the spec
// asks for.
func loadConfig(path string) (*fleetConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fail("reading -config: %v", err)
	}
	var f configFile
	entries, err := kvm2.ParseEntries(data, &f)
	if err != nil && len(egressproxy.FieldErrors(err)) == 0 {
		return nil, fail("%s: %v", path, err) // not YAML: nothing else can be read
	}
	problems := egressproxy.FieldErrors(err)
	field := func(name, value, rule string) {
		problems = append(problems, &egressproxy.FieldError{Field: name, Value: value, Rule: rule})
	}
	spec := egressproxy.Spec{ImageKey: f.Spec.ImageKey, MachineType: f.Spec.MachineType, Port: f.Spec.Port, UserData: f.Spec.UserData}
	cfg := &fleetConfig{Entries: entries, Spec: spec, Target: f.Target, RunningTimeout: f.RunningTimeout, ProgressInterval: f.ProgressInterval}
	for i, c := range entries {
		if rule := imageRule(c, spec.ImageKey); rule != "" {
			field(fmt.Sprintf("entries[%d].images", i), "", fmt.Sprintf("entry %s %s", c.Entry, rule))
		}
	}
	s := spec
	s.Name, s.UID = "fleet-1", "simple-fleet-check-1"
	for _, fe := range egressproxy.FieldErrors(s.Validate()) {
		field("spec."+specKey(fe.Field), fe.Value, fe.Rule)
	}
	if f.Target != "" {
		if host, port, err := net.SplitHostPort(f.Target); err != nil || host == "" || port == "" {
			field("target", f.Target, "want the host:port the proxies should CONNECT to (reachable from the VMs), e.g. example.com:443")
		}
	}
	for _, d := range []struct {
		name string
		to   *time.Duration
		def  time.Duration
	}{{"runningTimeout", &cfg.RunningTimeout, defaultRunningTimeout}, {"progressInterval", &cfg.ProgressInterval, defaultProgressInterval}} {
		switch {
		case *d.to == 0:
			*d.to = d.def
		case *d.to < 0:
			field(d.name, d.to.String(), `want a positive duration like "10m" or "500ms"`)
		}
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

// specKey is the key of a Spec field in the file: ImageKey → imageKey.
func specKey(goName string) string {
	if goName == "" {
		return goName
	}
	return strings.ToLower(goName[:1]) + goName[1:]
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
