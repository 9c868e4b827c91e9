"""claim"""
