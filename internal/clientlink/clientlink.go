package clientlink

// New returns an *egressproxy.Client over p, a driver.Provider, configured
// by opts, an *egressproxy.Options (nil valid).
var New func(p, opts any) any
