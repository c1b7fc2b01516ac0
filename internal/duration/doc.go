// Package duration is how configuration files write a duration: a string
// in time.ParseDuration syntax, never a bare number (which would read as
// nanoseconds).
package duration
