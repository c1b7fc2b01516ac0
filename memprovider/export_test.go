package memprovider

import "github.com/egressproxy/egressproxy/driver"

// NewDriver gives this package's external tests the driver itself, for the
// conformance suite, which drives a provider both through the client and
// directly.
func NewDriver(opts *Options) driver.Provider { return newProvider(opts) }

// NewDriverControl gives the driver and its Control.
func NewDriverControl(opts *Options) (driver.Provider, *Control) {
	p := newProvider(opts)
	return p, &Control{p: p}
}
