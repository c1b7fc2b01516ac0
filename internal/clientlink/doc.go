// Package clientlink lets package driver build the portable client of
// package egressproxy without egressproxy importing driver (driver's
// contract is written in egressproxy's types, so the import runs the other
// way). Package egressproxy sets New when it is initialised; every package
// that can reach driver has imported egressproxy, so New is set before any
// driver calls it.
package clientlink
