package kvm2_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/kvm2"
)

// entryJSON is one provider entry as an embedder might keep it in a
// configuration file: camelCase keys, durations as strings, zero values
// (defaults) left out. docs/config.md lists every field.
const entryJSON = `{
	"entry": "lab-1",
	"owner": "my-operator",
	"address": "hv1.example.net:22",
	"user": "egressproxy",
	"keyFile": "/etc/egressproxy/id_ed25519",
	"knownHostsFile": "/etc/egressproxy/known_hosts",
	"pool": "default",
	"images": {
		"debian-12": {
			"url": "https://images.example.net/debian-12-squid.qcow2",
			"sha256": "0f3c4e9a8b7d6c5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e"
		}
	},
	"callTimeout": "2m"
}`

// Open validates the Config and returns the portable client of the entry
// without touching the host: the first call dials.
func ExampleOpen() {
	cfg, err := kvm2.ParseConfig([]byte(entryJSON)) // strict: a mistyped key is an error
	if err != nil {
		fmt.Println(err)
		return
	}
	client, err := kvm2.Open(context.Background(), cfg, nil) // nil *Options: no logs, no spans
	if err != nil {
		fmt.Println(err)
		return
	}
	defer client.Close() // closes the entry's connections

	// What an embedder does next with the client (its first call dials the host):
	//
	//	inst, err := client.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: string(obj.UID)})
	//	switch {
	//	case err == nil: // inst.State, inst.Address()
	//	case errors.Is(err, egressproxy.ErrTransient): // requeue with backoff
	//	default: // report it; a person or a changed spec must act
	//	}
	fmt.Println("opened", cfg.Entry, "on", cfg.Address)
	// Output:
	// opened lab-1 on hv1.example.net:22
}

// ParseConfig reads YAML or JSON strictly: a mistyped key, or a duration
// written as a bare number (it would be nanoseconds), is a Permanent error
// naming the key, before anything is validated.
func ExampleParseConfig() {
	for _, doc := range []string{
		"entry: lab-1\nowner: my-operator\ncallTimout: 30s\n",
		"entry: lab-1\nowner: my-operator\ncallTimeout: 30\n",
	} {
		_, err := kvm2.ParseConfig([]byte(doc))
		for _, fe := range errs.FieldErrors(err) {
			fmt.Println(errs.Code(err), fe.Field)
		}
	}
	// Output:
	// Permanent callTimout
	// Permanent callTimeout
}

// A bad Config is one Permanent error naming every field that is wrong and
// its rule, so a configuration file is fixed in one pass.
func ExampleOpen_invalidConfig() {
	_, err := kvm2.Open(context.Background(), kvm2.Config{
		Entry:   "Lab_1",
		Owner:   "my-operator",
		Address: "hv1.example.net", // no port
		Network: "default",
		Bridge:  "br0", // a NIC joins one or the other
		// User, KeyFile, KnownHostsFile and Pool are missing.
	}, nil)
	fmt.Println(errs.Code(err))
	for _, fe := range errs.FieldErrors(err) {
		fmt.Println(fe.Field)
	}
	// Output:
	// Permanent
	// Entry
	// Address
	// User
	// KeyFile
	// KnownHostsFile
	// Pool
	// Bridge
}

// Check reports an unusable entry as a Health with a Reason rather than an
// error, so a controller can show it in a condition. Here the key file does
// not exist, which Check reports before dialing.
func ExampleOpen_check() {
	var cfg kvm2.Config
	if err := json.Unmarshal([]byte(entryJSON), &cfg); err != nil {
		fmt.Println(err)
		return
	}
	cfg.Address = "127.0.0.1:1"
	cfg.KeyFile = filepath.Join("testdata", "no-such-key")
	p, err := kvm2.Open(context.Background(), cfg, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := p.Check(ctx)
	fmt.Println(h.Reachable, h.Reason, err)

	p.Close()
	_, err = p.Check(ctx)
	fmt.Println(errors.Is(err, egressproxy.ErrClosed), egressproxy.Code(err))
	// Output:
	// false CredentialsUnavailable <nil>
	// true Permanent
}
