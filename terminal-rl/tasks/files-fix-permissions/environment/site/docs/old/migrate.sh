#!/bin/sh
echo migrate
