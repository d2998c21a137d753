"""persist"""
